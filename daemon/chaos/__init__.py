"""`batchd chaos`: every fault a deployment meets, at once, at volume, checked job by job."""

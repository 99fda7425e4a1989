"""``POST /v1/responses``: the Responses API's core on batchd jobs (:mod:`.endpoint`), and
its response object and stream events (:mod:`.shapes`)."""

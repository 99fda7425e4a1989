"""A request's way in and out of the engine beside the forward: the checks and state it
is admitted with, and the outputs its sampled tokens become."""

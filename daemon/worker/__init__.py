"""The worker: one daemon's loop and its parts (intake, pickup, control, publish, the engine)."""

"""The serving actors (prefill and decode instances, controller, S-/R-workers) and the HTTP frontend."""

"""The framework-neutral core: events and the report, the step history, diagnosis, recovery policy
and rendering. It works on plain numbers and records and imports neither torch nor TensorFlow."""

"""``raytron serve``: the job store, the gang queue, the scheduler loop and the job runners.

A job runner is a local process or a Ray Job; it runs the job through service.control."""

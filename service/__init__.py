"""The service between the API and the ranks, in four rooms by lifetime, each importing only
from the rooms below it (``tests/test_imports.py`` holds them to it):

* :mod:`service.spec`: what a job is (the spec, its rules, the placement plan); pure, no torch.
* :mod:`service.control`: one job's attempts (the controller, its events, errors and policies).
* :mod:`service.ranks`: where ranks run (local processes, Ray actors, the Ray cluster).
* :mod:`service.server`: ``raytron serve`` (the store, the queue, the scheduler, the job runners).
"""

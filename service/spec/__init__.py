"""What a job is: the spec, its rules and limits, its rank grid, placement plan and estimates.

Pure: no torch, no processes, no Ray."""

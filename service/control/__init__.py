"""One job's attempts: the controller (a state machine), its events, typed errors and policies.

No Ray, no database, no processes: it drives rank groups through the RankGroup protocol."""

"""Where ranks run: local processes or Ray actors (the launchers) and the Ray cluster they use.

Also: naming the rank that broke a call, and reaping what a session started."""

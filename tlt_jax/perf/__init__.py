"""Performance models: what the project predicts of runs it cannot make (`long_tail`: the long
tail of a rollout on D devices and what TLT recovers from it)."""

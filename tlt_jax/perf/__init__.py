"""Performance models: what the project predicts of runs it cannot make.

- `long_tail`: the long tail of a rollout on D devices and what TLT recovers from it;
- `cost_model`: FLOPs and bytes of each program, and their roofline time on a profile;
- `hardware`: the profiles (datasheet figures, one fitted figure each), `calibration`: the
  published points they are fitted to;
- `predict`: the cost model driving `long_tail` for a tlt-jax config (and `plan`'s breakdown).
- `measured`: bench_step_costs' measured program times, which win over the model at the same
  program, shape and profile.
"""

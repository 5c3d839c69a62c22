"""The project's lab, beside the payload it exercises (``megatron.bridge``'s EP overlap): what ``make run``, the
planner and the tests need and no Bridge training step calls.

* ``engine/``: a CPU-first reference engine that runs the schedule program with its own gradient sync and P2P (and
  ``off_host_lane.py``: the CPU lane that launches all-to-alls from a helper thread).
* ``program/``: the whole-step program (``program()``, the pipeline schedule, microbatch units), built on the
  payload's layer steps.
* ``moe_gpt/``: the reference MoE GPT (whole, or split into pipeline chunks).
* ``planner/``: prices the program, no torch; ``step_stats.py``: what a step's records add up to.
* ``multiprocess.py``: the fork launcher of local ranks and their EP groups; ``collectives.py``: the blocking
  collectives the lab runs; ``step.py``: a Bridge-style ``forward_step``/``train_step`` over the engine;
  ``placement.py``, ``storage_count.py``, ``pipeline_layout.py``: helpers of the above.
"""

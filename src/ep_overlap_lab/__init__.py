"""The project's lab, beside the payload it exercises (``megatron.bridge``'s EP overlap): what ``make run``, the
planner and the tests need and no Bridge training step calls.

* ``engine/``: a CPU-first reference engine that runs the schedule program with its own gradient sync and P2P.
* ``moe_gpt/``: the reference MoE GPT (whole, or split into pipeline chunks).
* ``planner/``: prices the program, no torch.
* ``multiprocess.py``: the fork launcher of local ranks; ``step.py``: a Bridge-style ``forward_step``/``train_step``
  over the engine; ``placement.py``, ``storage_count.py``, ``pipeline_layout.py``: helpers of the above.
"""

"""Policies: data-driven decisions that refine the quantization plan (`bitquilt.calib.plan`).

A policy is an engine stage of kind "policy": it measures something on calibration data and
writes its decision into the plan (and `plan.decisions[name]`). Scopes: static (the recipe's
globs and overrides, `Plan.static`), per block or per shared input (activation clipping, key
centres, below), and whole-model pre-pass (a global budget decided before any block is solved).
Importing this package registers the built-in policies.
"""

from bitquilt.policies import act_clip, dynamic_a8, gguf_mix, kv_center, mx_sens  # noqa: F401  (registration)

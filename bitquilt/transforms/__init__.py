"""Function-preserving rewrites applied before solving, registered as engine stages.

"block" transforms run inside the sequential engine on each decoder block with its calibration
inputs (AWQ, SmoothQuant); "model" transforms rewrite the whole model once before calibration
(QuaRot). Importing this package registers them all (see `bitquilt.calib.stages`).
"""

from bitquilt.transforms import awq, fold_perm, rotation, smoothquant  # noqa: F401  (registration)

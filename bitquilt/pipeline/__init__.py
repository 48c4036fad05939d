"""The quantization pipeline: recipes become a list of stages that the engine walks.

Importing it registers every built-in solver, transform and policy.
"""

from bitquilt import policies, solvers, transforms  # noqa: F401  (registration)
from bitquilt.pipeline import apply, recon, route  # noqa: F401  (register kv_quant, solve, reconstruction, routing)

"""Each compile backend's planning, one module per backend: what its artifact is built from
(the compiler command line, the ONNX Runtime settings), the settings its cache key is the digest
of, and the warnings its recipe settings earn.

The layers put compile above plan (a backend reads the plan), so the plan cannot ask a compile
backend; the planning half of each backend sits here, one layer below the plan, under the same
names as compile/backends.py (tests/test_backend_names.py checks the two agree). The plan loops
over BACKEND_PLANS and never names a backend.
"""

from __future__ import annotations

from .interface import BackendPlan, RoleFacts
from .onnxruntime import OrtPlan
from .qaic import QaicPlan

__all__ = ["BACKEND_PLANS", "BackendPlan", "RoleFacts"]

# Every backend's part is in every role's plan (`qpcbuild plan` shows them all), whichever the
# recipe builds for; its warnings only when the recipe builds for it.
BACKEND_PLANS: dict[str, BackendPlan] = {"onnxruntime": OrtPlan(), "qaic": QaicPlan()}

"""PyTorch adapters: `ODBDataLoader`, the gloo transport, loss scaling, resumable state.

Importing this subpackage imports torch; `import odb_core` alone does not.
"""

from __future__ import annotations

from odb_core.torch.loader import ODBDataLoader
from odb_core.torch.loss import scale_loss
from odb_core.torch.source import SampleLoadError
from odb_core.torch.state import merge_states

__all__ = ["ODBDataLoader", "SampleLoadError", "merge_states", "scale_loss"]

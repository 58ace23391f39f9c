"""Trainer integrations, one module per trainer library.

Each module (`odb_core.integrations.hf`, `.accelerate`, `.lightning`) imports its
trainer library when it is itself imported; importing this package imports no
trainer library and not torch.
"""

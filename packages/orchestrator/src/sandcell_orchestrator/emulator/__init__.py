"""A local emulator of AWS Lambda MicroVMs whose VMs are real runner processes.

Test and demo infrastructure: ``python -m sandcell_orchestrator.emulator --port N``.
"""

from __future__ import annotations

from .admin import RecordedCall
from .lambda_microvms import MicrovmEmulator, serve_in_thread
from .vm import EmulatedVm, EmulatorClock, Faults, VmState

__all__ = [
    "EmulatedVm",
    "EmulatorClock",
    "Faults",
    "MicrovmEmulator",
    "RecordedCall",
    "VmState",
    "serve_in_thread",
]

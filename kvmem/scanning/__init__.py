"""The main job: stream a corpus through the model and keep, per neuron, what triggers it."""

from kvmem.scanning.config import ScanConfig
from kvmem.scanning.merge import merge
from kvmem.scanning.runner import scan

__all__ = ["scan", "merge", "ScanConfig"]

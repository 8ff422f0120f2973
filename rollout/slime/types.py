"""slime's rollout data types, from slime itself: the adapter runs where slime calls it, so slime is importable
(tests without slime install a stand-in under slime's module names: tests/support/slime_standin.py)."""
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.types import Sample

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "Sample"]

"""Drafters propose tokens for the target to verify; one proposer per module (as in vLLM)."""

from .base import Drafter, Proposal
from .draft_model import DraftModelDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "Proposal", "DraftModelDrafter", "PromptLookupDrafter"]

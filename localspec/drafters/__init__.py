"""Drafters propose tokens for the target to verify; one proposer per module (as in vLLM), one contract
(base.Drafter), and a registry of the kinds there are (registry.py)."""

from localspec.drafters.base import Drafter, Offer, Proposal
from localspec.drafters.chain import ChainedDrafter, chained
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["ChainedDrafter", "chained", "Drafter", "Offer", "Proposal", "DraftModelDrafter", "PromptLookupDrafter"]

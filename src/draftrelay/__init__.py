"""draftrelay: remote speculative drafting for LLM serving."""

__version__ = "0.1.0"

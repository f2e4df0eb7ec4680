"""DeepSeek-V3-style sequential multi-token prediction modules on a frozen target (the mtp drafter)."""

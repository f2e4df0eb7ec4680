"""EAGLE heads (Li et al. 2024a EAGLE-1; 2025 EAGLE-3): a one-layer head autoregressing on target features.

head (the module, both variants), train (EAGLE-1's feature + token loss with noise; EAGLE-3's training-time
test; per-depth accuracy), store (trained heads cached next to the zoo), checkpoint (the published EAGLE and
EAGLE-3 layouts, which are also ours), tree (EAGLE-2's dynamic tree). The drafter is methods.drafters.eagle.
"""

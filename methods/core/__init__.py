"""Floor 0, the decode core: the Drafter protocol (drafter), the KV-cached tree-attention engine (engine,
fast_llama), the one decode loop (loop), the verifiers (verify) and samplers (sampling), acceptance statistics
(metrics) and the engine's t(n) timer (timing). Imports torch, transformers and specsim only."""

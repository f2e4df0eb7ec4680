"""Floor 3, modules trained on a frozen target: the shared training loop (trainer), Medusa heads (medusa/),
EAGLE heads (eagle/), MTP modules (mtp/). Imports the core, data and the zoo."""

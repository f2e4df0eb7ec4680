"""Floor 3, modules trained on a frozen target: Medusa heads (medusa/). Imports the core, data and the zoo."""

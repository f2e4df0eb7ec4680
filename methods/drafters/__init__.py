"""Drafters: one file per method, each a class implementing methods.core.drafter.Drafter with
``from_config(method, tree, models, sampling)``;
methods.drafters.registry maps ``method.drafter`` names to them."""

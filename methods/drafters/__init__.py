"""Drafters: one file per method, each a class implementing methods.drafter.Drafter with
``from_config(method, tree, models, sampling)``; methods.registry maps ``method.drafter`` names to them."""

"""Model families, one module each; importing a module registers its families
(``runtime/models/registry.py`` imports every module here)."""

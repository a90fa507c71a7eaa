"""pagedgen on Ray Data: ``pagedgen.ray.Generator`` for pipelines of your own
(``cli/ray/generator.py``); ``pagedgen generate --ray`` runs on
``runtime/drivers/ray_data.py``. (This folder is the package ``pagedgen.ray``.)"""

from pagedgen.ray.generator import Generator

__all__ = ["Generator"]

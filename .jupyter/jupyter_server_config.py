# Jupyter server settings for the kvlab chapters: read by `make lab` and tools/lab_check.py
# (JUPYTER_CONFIG_PATH=.jupyter) and by Binder (whose home, and so ~/.jupyter, is this folder).
#
# A chapter stores the `language_info` of the kernel that executed it (the .ipynb always did; the
# .md header keeps it, notebooks/jupytext.toml), because a kernel writes its own into the
# notebook as it starts and Lab marks the notebook modified when that differs. The Python
# *version* in it differs on every machine whose Python is not the one the book was executed
# with, so there a chapter opened marked modified and a save rewrote its header. This contents
# manager hands Lab the notebook with the version of the Python serving it (the kernels of
# `make lab` and Binder run in that same environment) and, on save, writes back the version the
# file already stored: a chapter opens unmodified and saves unchanged under any Python.
# (tools/lab_check.py checks it with a copy whose header names another version.)

# A chapter's .md source cannot store Lab's collapse state (notebooks/jupytext.toml keeps the
# `jupyter` cell metadata out of it, so expanding a solution never changes the source), so this
# manager also collapses the solution cells (tag hide-cell or solution) of a .md as it opens,
# as tools/execute_notebook.py stores them collapsed in the .ipynb; the filter drops the state
# again on save.
#
# JupyterLab itself shows every output of a cell it runs, and a save then drops the cell's
# `outputs_hidden`: the book's Lab extension in labextensions/ (kvlab-solutions, a prebuilt
# extension written by hand) hides an unopened solution's outputs again as it runs, so Run All
# and a save keep the solutions collapsed. Its folder is added to Lab's extension path here.

import platform
from pathlib import Path

from jupytext import AsyncTextFileContentsManager


def _python_info(model):
    """The notebook's ``language_info`` if it is Python's, else None."""
    if not model or model.get("type") != "notebook" or not isinstance(model.get("content"),
                                                                       dict):
        return None
    info = model["content"].get("metadata", {}).get("language_info")
    return info if isinstance(info, dict) and info.get("name") == "python" else None


_SOLUTION_TAGS = {"hide-cell", "solution"}


class KvlabContentsManager(AsyncTextFileContentsManager):
    """Jupytext's contents manager, with the stored Python version kept out of Lab's sight."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        info = _python_info(model)
        if info is not None and "version" in info:
            info["version"] = platform.python_version()
        if info is not None and path.endswith(".md"):
            for cell in model["content"].get("cells", []):
                if cell.get("cell_type") == "code" and _SOLUTION_TAGS & set(
                        cell.get("metadata", {}).get("tags", [])):
                    cell["metadata"].setdefault("jupyter", {}).update(
                        source_hidden=True, outputs_hidden=True)
        return model

    async def save(self, model, path=""):
        info = _python_info(model)
        if info is not None and "version" in info and await self.file_exists(path):
            stored = _python_info(await super().get(path, content=True, type="notebook"))
            if stored is not None and "version" in stored:
                info["version"] = stored["version"]
        return await super().save(model, path)


c = get_config()  # noqa: F821  (defined by traitlets when it loads this file)
c.ServerApp.contents_manager_class = KvlabContentsManager
c.LabApp.extra_labextensions_path = [str(Path(__file__).resolve().parent / "labextensions")]

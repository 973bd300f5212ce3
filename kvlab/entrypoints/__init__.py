"""kvlab.entrypoints: the command-line programs.

``python -m kvlab serve`` (:mod:`.serve`): an OpenAI-compatible HTTP server over the engine;
``python -m kvlab bench`` (:mod:`.bench`): an open-loop load client for any OpenAI-compatible
server. Nothing here is imported by ``import kvlab``.
"""

"""`sluice serve`: ComfyUI's HTTP and websocket API in front of Sluice's engine, so ComfyUI clients (Krita AI
Diffusion, Open WebUI, SillyTavern, scripts, bots) and `sluice run --server` drive it.

    server.py         SluiceServer (aiohttp app, websockets, the request guard) and BackgroundServer
    routes.py         ComfyUI's routes and their JSON shapes
    engine_thread.py  the one engine thread: runs queued prompts with the Executor, sends ComfyUI's messages
    queue.py          the prompt queue and the history
    prompts.py        API prompt -> the workflow to run, or ComfyUI's validation error shape
    schema.py         /object_info: Sluice's node types in ComfyUI's schema
    files.py          the output, input and temp folders, and the checks on every path a request names
    main.py           the `sluice serve` command
    client.py         `sluice run --server URL`: run a workflow on a running server

This package is an app layer: engine/ and nodes/ never import it (nor aiohttp).
"""

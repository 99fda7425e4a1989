"""``batchd dashboard``: the queue, the fleet and every job, live, in a browser.

A separate command (not a gateway route) on the gateway's stack (starlette, uvicorn,
Jinja2): it answers operators, not API clients, so it takes its own key (an operator
key, never a gateway key), binds to its own address (an internal network, while the
gateway may face the internet), and reads and acts on the whole fleet where the gateway
sees only its callers' jobs. :func:`batchd.producers.dashboard.app.create_app` is a
plain ASGI app, so a deployment may also mount it under the gateway's.

Pages are rendered on the server (Jinja2, autoescaped) and kept live over
Server-Sent Events: the overview's sections arrive as ready HTML rendered once per tick
for every viewer, a job's tokens as text that the page appends. Everything is served by
batchd itself (no CDN, no Node build): a small hand-written JS and CSS, inline SVG
sparklines. Reading is open; actions need an operator session (see :mod:`.auth`).
"""

"""`txl serve`: a local playground over one or two trained runs (issue 20).

`engine` holds the model work (decoding state per client, scoring with attention), `app` the HTTP API
and its limits (Starlette, the optional `serve` extra), `cli` the command; the page lives in
`static/` and is shipped with the package, so it works offline.
"""

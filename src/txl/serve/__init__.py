"""`txl serve`: a local playground over one or two trained runs (issue 20).

`engine` holds the model work (decoding state per client on the library's one decoder, scoring with
attention), `app` the HTTP API (Starlette, the optional `serve` extra), `requests` its limits and
request bodies, `sessions` the clients' decoding states within a memory budget, `connections` the
connection guard, `load` the start-up checks; the command is `txl.cli.serve`. The page lives in
`static/` and is shipped with the package, so it works offline.
"""

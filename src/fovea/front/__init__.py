"""``fovea serve --topology e_pd --pd-workers M``: one HTTP front before M prefill/decode workers.

The front loads no model. It starts and supervises N shared encode workers (``encode_server``,
on Unix sockets) and M PD workers (each a full ``fovea serve`` on a loopback port, whose encoder
pool connects to those sockets), and proxies HTTP to the PD workers: generation to the one with
the fewest requests in flight, image uploads to all of them. docs/disaggregation.md.
"""

"""The engine core in a process of its own (``core_main``), and what the API process uses to
talk to it (``client``) over ZeroMQ (``wire``): requests in, events out, pixels through shared
memory."""

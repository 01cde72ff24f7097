"""Tool calling on chat (and, through ``fovea.serve.responses.tools``, on /v1/responses): the
requests' tools checked, rendered and parsed back from the answer (``calls``), one call's JSON
read a character at a time (``scanner``), calls followed as the answer streams (``stream``) and
chat's ``tool_calls`` chunks (``chunks``).
"""

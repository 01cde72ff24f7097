"""OpenAI's Responses API (POST, GET and DELETE /v1/responses): the routes (``routes``), the
request schema and answer shapes (``api``), the table of its request fields (``fields``), the
output items built as tokens arrive (``output``), the stored responses (``store``) and function
tools in its shapes over chat's (``tools``).
"""

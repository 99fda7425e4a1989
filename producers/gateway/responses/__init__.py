"""``POST /v1/responses``: the Responses API's core on batchd jobs (:mod:`.endpoint`), its
input items (:mod:`.inputs`) and its own request fields (:mod:`.fields`), and its response
object and stream events (:mod:`.shapes`)."""

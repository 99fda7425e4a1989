"""OpenAI tool calling: tools into the prompt and calls out of the text (:mod:`.calls`),
and chat messages with calls and results in them (:mod:`.messages`)."""

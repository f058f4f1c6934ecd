"""The model as training runs it: loading (:mod:`.model`), the chunked loss (:mod:`.loss`),
sharding with FSDP2 (:mod:`.parallel`), the memory plan (:mod:`.plan`), the bytes a step sends
(:mod:`.traffic`), and the exported Hugging Face model (:mod:`.export`)."""

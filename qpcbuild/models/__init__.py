"""The model files a recipe names, read without running them: where a model comes from
(source.py: a local folder, the Hugging Face cache or the shipped table of public configs), its
architecture (arch.py: the facts config.json gives, one row per supported family), its safetensors read
header first and tensor by tensor (safetensors.py), its checkpoint against its config
(checkpoint.py), the draft's tokenizer against the target's (tokenizer_check.py), a draft's
vocabulary subset (vocab_subset.py), the graph's I/O (graph_io.py) and its compiled shapes
(specialization.py).

Nothing here knows the recipe: the plan joins the two. Names are imported from their modules
(this file re-exports nothing), so a caller loads only the readers it uses."""

"""Other tools' entry points: PyG's explainer (:mod:`.pyg`), inseq (:mod:`.inseq`), Captum Insights
(:mod:`.insights`) and Captum's LLM layer methods (:mod:`.captum_llm_layers`).
"""

from keel.model.llama import Llama

__all__ = ["Llama"]

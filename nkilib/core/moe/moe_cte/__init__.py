"""nkilib.core.moe.moe_cte: blockwise MoE for context encoding (AWS NKI-lib layout)."""

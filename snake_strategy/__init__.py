"""snake_strategy: SSD-offloaded training for PyTorch Lightning with the GreedySnake schedule.

``import snake_strategy`` registers ``Trainer(strategy="greedysnake")``.
"""
from lightning.pytorch.strategies import StrategyRegistry

from snake_strategy.config import ScheduleConfig, StorageConfig, TierShares
from snake_strategy.moved import renamed
from snake_strategy.contract import check_contract
from snake_strategy.engine import EngineHooks
from snake_strategy.module import LayeredModule
from snake_strategy.precision import GreedySnakePrecision
from snake_strategy.progress import Progress, ProgressEvent
from snake_strategy.strategy import GreedySnakeStrategy

GreedySnakeStrategy.register_strategies(StrategyRegistry)

# pre_stage may return (hidden, side_inputs); the engine passes side inputs to every block.
SUPPORTS_SIDE_INPUTS = True

__all__ = [
    "EngineHooks", "GreedySnakePrecision", "GreedySnakeStrategy", "LayeredModule", "Progress", "ProgressEvent", "ScheduleConfig", "StorageConfig",
    "TierShares", "check_contract",
]
__version__ = "0.1.0"

__getattr__ = renamed(__name__)  # TierSplit, the old name of TierShares (snake_strategy/moved.py)

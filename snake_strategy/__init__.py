"""snake_strategy: SSD-offloaded training for PyTorch Lightning with the GreedySnake schedule.

``import snake_strategy`` registers ``Trainer(strategy="greedysnake")``.
"""
from lightning.pytorch.strategies import StrategyRegistry

from snake_strategy.config import ScheduleConfig, StorageConfig, TierSplit
from snake_strategy.contract import LayeredModule, check_contract
from snake_strategy.precision import GreedySnakePrecision
from snake_strategy.strategy import GreedySnakeStrategy

GreedySnakeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "GreedySnakePrecision", "GreedySnakeStrategy", "LayeredModule", "ScheduleConfig", "StorageConfig",
    "TierSplit", "check_contract",
]
__version__ = "0.1.0"

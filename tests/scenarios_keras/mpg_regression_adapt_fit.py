# Fuel-efficiency regression (the TensorFlow "basic regression" tutorial on the
# Auto MPG table): one-hot origin, a Normalization layer adapted on the training
# features, a two-hidden-layer DNN trained with model.fit on mean absolute error.
# The raw table marks unknown horsepower with "?", read in as missing.
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)

n = 398
cylinders = rng.choice([4, 6, 8], n, p=[0.52, 0.21, 0.27])
displacement = cylinders * rng.normal(40, 6, n)
horsepower = 0.35 * displacement + rng.normal(25, 8, n)
weight = 700 + 9 * displacement + rng.normal(0, 250, n)
acceleration = 24 - 0.04 * horsepower + rng.normal(0, 1.5, n)
model_year = rng.integers(70, 83, n)
origin = rng.choice([1, 2, 3], n, p=[0.62, 0.18, 0.20])
mpg = (46 - 0.006 * weight - 0.05 * horsepower + 0.6 * (model_year - 76)
       + 1.5 * (origin > 1) + rng.normal(0, 2.5, n)).clip(9, 47)
raw = [str(round(h)) for h in horsepower]
for i in rng.choice(n, 6, replace=False):
    raw[i] = "?"
horsepower_col = np.array([float(v) if v != "?" else np.nan for v in raw])

columns = ["Cylinders", "Displacement", "Horsepower", "Weight", "Acceleration",
           "Model Year", "Europe", "Japan", "USA"]
dataset = np.stack([cylinders, displacement, horsepower_col, weight, acceleration,
                    model_year, origin == 2, origin == 3, origin == 1], axis=1).astype("float32")

order = rng.permutation(n)
train_idx, test_idx = order[:int(0.8 * n)], order[int(0.8 * n):]
train_features, test_features = dataset[train_idx], dataset[test_idx]
train_labels, test_labels = mpg[train_idx].astype("float32"), mpg[test_idx].astype("float32")

normalizer = layers.Normalization(axis=-1)
normalizer.adapt(np.array(train_features))


def build_and_compile_model(norm):
    model = keras.Sequential([
        norm,
        layers.Dense(64, activation="elu"),
        layers.Dense(64, activation="elu"),
        layers.Dense(1),
    ])
    model.compile(loss="mean_absolute_error", optimizer=keras.optimizers.Adam(0.001))
    return model


dnn_model = build_and_compile_model(normalizer)

losses = []


def log_step(batch, logs):
    print(f"step={len(losses)} loss={logs['loss']:.6f}")
    losses.append(float(logs["loss"]))


history = dnn_model.fit(
    train_features, train_labels,
    validation_split=0.2, batch_size=32, verbose=0, epochs=30,
    callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=log_step)])
print("test MAE:", dnn_model.evaluate(test_features, test_labels, verbose=0))
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")

# House price regression on Ames-style tabular features (keras-io structured
# data / TF "basic regression" pattern). Preprocessing lives inside the model so
# it ships with it: a Normalization layer (adapted on the training split) for
# the count/year columns and a log1p Lambda for the square-footage columns,
# then a small MLP. Trained with mixed precision (mixed_float16) in a custom
# GradientTape loop, with the LossScaleOptimizer handling the loss scale.
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)

n = 1460
lot_area = rng.lognormal(9.1, 0.4, n)
lot_area[rng.choice(n, 4, replace=False)] = [215245.0, 164660.0, 159000.0, 115149.0]
gr_liv_area = rng.lognormal(7.27, 0.33, n)
total_bsmt_sf = np.clip(gr_liv_area * rng.uniform(0.5, 1.1, n), 0, None)
overall_qual = rng.integers(1, 11, n)
year_built = rng.integers(1872, 2011, n)
garage_cars = rng.integers(0, 5, n)
log_price = (10.2 + 0.09 * overall_qual + 0.45 * np.log(gr_liv_area / 1500)
             + 0.12 * np.log(lot_area / 10000) + 0.003 * (year_built - 1970)
             + 0.06 * garage_cars + rng.normal(0, 0.12, n))

areas = np.stack([lot_area, gr_liv_area, total_bsmt_sf], axis=1).astype("float32")
counts = np.stack([overall_qual, year_built, garage_cars], axis=1).astype("float32")
target = log_price.astype("float32")[:, None]
idx = rng.permutation(n)
train_idx, val_idx = idx[:1168], idx[1168:]
x_train = (areas[train_idx], counts[train_idx])
y_train = target[train_idx]
x_val, y_val = (areas[val_idx], counts[val_idx]), target[val_idx]

normalizer = keras.layers.Normalization(axis=-1)
normalizer.adapt(x_train[1])

area_in = keras.Input((3,), name="areas")
count_in = keras.Input((3,), name="counts")
log_areas = keras.layers.Lambda(lambda a: tf.math.log1p(a), name="log_area")(area_in)
h = keras.layers.Concatenate()([log_areas, normalizer(count_in)])
h = keras.layers.Dense(64, activation="gelu")(h)
h = keras.layers.Dense(64, activation="gelu")(h)
outputs = keras.layers.Dense(1, dtype="float32")(h)
model = keras.Model([area_in, count_in], outputs)

optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(3e-3))
loss_fn = keras.losses.MeanSquaredError()


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = loss_fn(y, pred)
        scaled_loss = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled_loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss


train_ds = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(len(y_train), seed=0, reshuffle_each_iteration=True)
            .batch(32))

losses = []
for epoch in range(5):
    for xb, yb in train_ds:
        loss = float(train_step(xb, yb))
        print(f"step={len(losses)} loss={loss:.6f}")
        losses.append(loss)
    val_mse = float(loss_fn(y_val, model(x_val, training=False)))
    print(f"epoch {epoch}: val_mse={val_mse:.4f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")

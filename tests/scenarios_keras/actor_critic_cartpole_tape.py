# Actor-critic on CartPole, following the keras.io "Actor Critic Method"
# example (shared hidden layer, softmax actor head, value head, one
# GradientTape per episode, Huber critic loss, normalized returns). The
# environment is a small numpy CartPole (same dynamics as gym's CartPole-v0),
# and the agent explores with epsilon-greedy on top of the policy's sampling.
import math
import numpy as np
import tensorflow as tf
import keras
from keras import layers

keras.utils.set_random_seed(0)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
rng = np.random.default_rng(0)


class CartPole:
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02

    def reset(self):
        self.state = rng.uniform(-0.05, 0.05, 4)
        return self.state.astype("float32")

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        total_mass = self.masspole + self.masscart
        pml = self.masspole * self.length
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + pml * theta_dot ** 2 * sin) / total_mass
        thetaacc = (self.gravity * sin - cos * temp) / (self.length * (4.0 / 3.0 - self.masspole * cos ** 2 / total_mass))
        xacc = temp - pml * thetaacc * cos / total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * xacc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * thetaacc
        self.state = np.array([x, x_dot, theta, theta_dot])
        done = abs(x) > 2.4 or abs(theta) > 12 * 2 * math.pi / 360
        return self.state.astype("float32"), 1.0, done


gamma = 0.99
max_steps_per_episode = 200
explore = 0.1
env = CartPole()
eps = np.finfo(np.float32).eps.item()

num_inputs, num_actions, num_hidden = 4, 2, 128
inputs = layers.Input(shape=(num_inputs,))
common = layers.Dense(num_hidden, activation="relu")(inputs)
action = layers.Dense(num_actions, activation="softmax")(common)
critic = layers.Dense(1)(common)
model = keras.Model(inputs=inputs, outputs=[action, critic])

optimizer = keras.optimizers.Adam(learning_rate=0.02)
huber_loss = keras.losses.Huber()
action_probs_history, critic_value_history, rewards_history = [], [], []
losses = []

for episode in range(100):
    state = env.reset()
    with tf.GradientTape() as tape:
        for timestep in range(1, max_steps_per_episode):
            state = tf.expand_dims(tf.convert_to_tensor(state), 0)
            action_probs, critic_value = model(state)
            critic_value_history.append(critic_value[0, 0])
            if rng.random() < explore:
                action = int(rng.integers(num_actions))
            else:
                action = int(rng.random() < float(action_probs[0, 1]))
            action_probs_history.append(tf.math.log(action_probs[0, action]))
            state, reward, done = env.step(action)
            rewards_history.append(reward)
            if done:
                break

        returns = []
        discounted_sum = 0
        for r in rewards_history[::-1]:
            discounted_sum = r + gamma * discounted_sum
            returns.insert(0, discounted_sum)
        returns = np.array(returns)
        returns = ((returns - np.mean(returns)) / (np.std(returns) + eps)).tolist()

        actor_losses, critic_losses = [], []
        for log_prob, value, ret in zip(action_probs_history, critic_value_history, returns):
            diff = ret - value
            actor_losses.append(-log_prob * diff)
            critic_losses.append(huber_loss(tf.expand_dims(value, 0), tf.expand_dims(ret, 0)))
        loss_value = sum(actor_losses) + sum(critic_losses)
    grads = tape.gradient(loss_value, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    action_probs_history.clear()
    critic_value_history.clear()
    rewards_history.clear()
    print(f"step={episode} loss={float(loss_value):.6f}")
    losses.append(float(loss_value))
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
